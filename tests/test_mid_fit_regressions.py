"""A saved MID fit is bound to the model files it was fitted on, by content: new weights in the same folder (or a
hub id at another commit) are refused in one line, the same files under another path or built apart are
accepted without a word, and an older fit without the digest keeps its check by name, saying it cannot be
verified. Scores of the accepted fits are held to the independent computation of tests/test_mid.py."""
from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from conftest import EXAMPLES, cli, one_line
from safetensors.torch import load_file, save_file
from test_mid import TOL, corpus, plain_mid

import capeval_plugins
from capeval_plugins.core.gaussian import sums_to_bytes
from capeval_plugins.core.messages import DataError
from capeval_plugins.metrics.mid import load_fit
from capeval_plugins.testing import build_tiny

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def fit_on(model: str, path, **options) -> str:
    capeval_plugins.load("mid", model=model, **options).fit_reference(corpus()[0], corpus()[2], save_to=str(path))
    return str(path)


def perturb_in_place(folder) -> None:
    """New weights of the same names and shapes, as a fine-tune saved over the folder would leave."""
    weights = load_file(str(folder / "model.safetensors"))
    noise = torch.Generator().manual_seed(1)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=noise) if v.is_floating_point() else v
               for k, v in weights.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})


def fit_warnings(load):
    """The metric ``load()`` returns, and its warnings about which model the fit was made with."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metric = load()
    return metric, [str(w.message) for w in caught if "fitted on" in str(w.message)]


@pytest.fixture(scope="module")
def expected(tiny_clip):
    return plain_mid(tiny_clip, *corpus())


def test_new_weights_in_the_same_folder_are_refused_in_one_line(tiny_clip, tmp_path, capsys):
    model = tmp_path / "clip"
    shutil.copytree(tiny_clip, model)
    fit = fit_on(str(model), tmp_path / "fit.npz")
    perturb_in_place(model)
    with pytest.raises(DataError) as refused:
        capeval_plugins.load("mid", model=str(model), reference_gaussian=fit)
    message = str(refused.value)
    assert message.count(str(model)) == 2 and "\n" not in message, message  # the fit's model and the one given
    assert message.endswith("fit again with fit_reference, or pass the model the fit was made with"), message
    capsys.readouterr()  # the fit's progress bars
    code, _, err = cli(["score", "-m", "mid", "--model", model, "-o", f"reference_gaussian={fit}", "--captions",
                        EXAMPLES / "captions.jsonl", "--images", EXAMPLES / "images", "--quiet"], capsys)
    assert code == 2 and one_line(err) and "holds other files" in err, err


def test_new_weights_saved_while_a_metric_holds_its_fit_are_refused_at_the_next_score(tiny_clip, tmp_path):
    """The fit was checked against the model's files when the metric was built; a metric kept across a rebuild
    of its folder scored the new weights with the old fit."""
    images, cands, _ = corpus()
    model = tmp_path / "clip"
    shutil.copytree(tiny_clip, model)
    metric = capeval_plugins.load("mid", model=str(model), reference_gaussian=fit_on(str(model), tmp_path / "fit.npz"))
    first = metric(images, cands).score
    assert metric(images, cands).score == pytest.approx(first, abs=1e-9)  # the same model: no check again
    perturb_in_place(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the process loads the model again, with a warning)
        with pytest.raises(DataError, match="holds other files"):
            metric(images, cands)


@pytest.mark.parametrize("elsewhere", ["copied", "built apart"])
def test_the_same_files_under_another_path_are_accepted_without_a_warning(tiny_clip, expected, tmp_path, elsewhere):
    fit = fit_on(tiny_clip, tmp_path / "fit.npz")
    other = tmp_path / "other"
    shutil.copytree(tiny_clip, other) if elsewhere == "copied" else build_tiny("clip", other)
    later, said = fit_warnings(lambda: capeval_plugins.load("mid", model=str(other), reference_gaussian=fit))
    assert said == []
    images, candidates, _ = corpus()
    assert later(images[:3], candidates[:3]).scores.tolist() == pytest.approx(expected[:3].tolist(), **TOL)


def test_an_older_fit_without_the_digest_is_checked_by_name_and_says_it_cannot_be_verified(tiny_clip, expected,
                                                                                          tmp_path):
    fit = fit_on(tiny_clip, tmp_path / "fit.npz", preprocessing="transformers")  # inputs as older versions made
    saved = load_fit(fit)
    old = tmp_path / "old.npz"  # the header this package wrote before the digest (and before preprocessing)
    old.write_bytes(sums_to_bytes(saved.sums, saved.dim_x, model=tiny_clip, fit_pairs="all_references", n_skipped=0))
    other = tmp_path / "other"
    shutil.copytree(tiny_clip, other)
    _, said = fit_warnings(lambda: capeval_plugins.load("mid", model=str(other), reference_gaussian=str(old),
                                                        preprocessing="transformers"))
    assert len(said) == 1 and tiny_clip in said[0] and "cannot be verified" in said[0], said
    same, said = fit_warnings(lambda: capeval_plugins.load("mid", model=tiny_clip, reference_gaussian=str(old),
                                                           preprocessing="transformers"))
    assert said == []
    images, candidates, _ = corpus()
    recorded = capeval_plugins.load("mid", model=tiny_clip, reference_gaussian=fit, preprocessing="transformers")
    assert same(images[:3], candidates[:3]).scores.tolist() == pytest.approx(
        recorded(images[:3], candidates[:3]).scores.tolist(), **TOL)
    with pytest.raises(DataError, match="fed as preprocessing='transformers', but this metric feeds them as "
                                        "'official'; .*pass preprocessing='transformers'"):
        capeval_plugins.load("mid", model=tiny_clip, reference_gaussian=str(old))  # an older fit: the processor's


def test_a_fit_of_float32_features_is_refused_for_bfloat16_ones(tiny_clip, tmp_path):
    fit = fit_on(tiny_clip, tmp_path / "fit.npz")
    assert load_fit(fit).metadata["feature_dtype"] == "float32"
    capeval_plugins.load("mid", model=tiny_clip, dtype="float32", reference_gaussian=fit)
    with pytest.raises(DataError, match=r"fitted on float32 features .* computes bfloat16 ones; .*pass dtype=float32"):
        capeval_plugins.load("mid", model=tiny_clip, dtype="bfloat16", reference_gaussian=fit)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding ``capeval-test/tiny-clip``; ``publish(folder, commit)`` adds a snapshot and
    points ``main`` at it."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    repo = cache / "models--capeval-test--tiny-clip"

    def publish(folder, commit: str) -> str:
        shutil.copytree(folder, repo / "snapshots" / commit, ignore=shutil.ignore_patterns(".*"))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
        return "capeval-test/tiny-clip"

    return publish


def test_a_hub_model_is_checked_by_its_commit_and_its_files(tiny_clip, expected, tmp_path, hub_cache):
    hub_id = hub_cache(tiny_clip, COMMIT_A)
    fit = fit_on(hub_id, tmp_path / "fit.npz")
    assert load_fit(fit).metadata["model_commit"] == COMMIT_A
    local, said = fit_warnings(lambda: capeval_plugins.load("mid", model=tiny_clip, reference_gaussian=fit))
    assert said == []  # the snapshot's files, in a local folder
    images, candidates, _ = corpus()
    assert local(images[:3], candidates[:3]).scores.tolist() == pytest.approx(expected[:3].tolist(), **TOL)
    changed = tmp_path / "changed"
    shutil.copytree(tiny_clip, changed)
    perturb_in_place(changed)
    hub_cache(changed, COMMIT_B)  # main moves to a commit with new weights
    with pytest.raises(DataError, match=f"fitted on features of {hub_id} .*, but the model given, {hub_id}, holds "
                                        "other files"):
        capeval_plugins.load("mid", model=hub_id, reference_gaussian=fit)
    capeval_plugins.load("mid", model=hub_id, revision=COMMIT_A, reference_gaussian=fit)  # the fit's commit


def test_a_hub_model_cached_only_when_it_loads_is_checked_then(tiny_clip, tmp_path, hub_cache, monkeypatch):
    from capeval_plugins.metrics import mid

    model = tmp_path / "clip"
    shutil.copytree(tiny_clip, model)
    fit = fit_on(str(model), tmp_path / "fit.npz")
    metric = capeval_plugins.load("mid", model="capeval-test/tiny-clip", reference_gaussian=fit, batch_size=8,
                                  on_error="skip")  # not cached yet: nothing to compare
    perturb_in_place(model)
    hub_cache(model, COMMIT_B)  # what the download brings: other weights
    hashed, digest = [], mid.model_files_digest
    monkeypatch.setattr(mid, "model_files_digest", lambda *a: hashed.append(a) or digest(*a))
    images, candidates, _ = corpus()
    with pytest.raises(DataError, match="holds other files"):
        metric(images[:8], candidates[:8])
    assert len(hashed) == 1  # once, not again for each part of the batch split in search of a faulty sample


def test_a_fit_of_other_pairs_is_refused_not_scored_under_another_name(tiny_clip, tmp_path):
    """fit_pairs selects the pairs summed into a fit; with a saved fit it was accepted and ignored: the fit's own
    pairs scored while the configuration said otherwise."""
    fit = fit_on(tiny_clip, tmp_path / "fit.npz")
    assert load_fit(fit).metadata["fit_pairs"] == "all_references"
    capeval_plugins.load("mid", model=tiny_clip, reference_gaussian=fit, fit_pairs="all_references")
    with pytest.raises(DataError, match=r"fitted on fit_pairs='all_references', but this metric selects "
                                        r"'first_reference'; .*pass fit_pairs='all_references'"):
        capeval_plugins.load("mid", model=tiny_clip, reference_gaussian=fit, fit_pairs="first_reference")
