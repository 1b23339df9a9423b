"""A stand-in for METEOR's `-stdio` protocol, for tests of the Java plumbing (no JVM, answers at once).

SCORE ||| refs ... ||| hyp  ->  "<len(hyp) + 0.5> <number of refs>.0" (not whole numbers: the client lets EVAL
add them up); EVAL ||| stats ...  ->  one line per stats (their sum), then the sum of all. Its first argument
names what to do when a SCORE request contains its second argument: "die" (exit 1 saying so on stderr),
"hang" (never answer), "garbage" (answer out of protocol); "ok" never misbehaves."""
import sys
import time

mode, trigger = sys.argv[1], sys.argv[2]
for line in sys.stdin:
    fields = [f.strip() for f in line.rstrip("\n").split("|||")]
    if fields[0] == "SCORE":
        if trigger in line and mode == "die":
            print('Exception in thread "main" java.lang.OutOfMemoryError: Java heap space (fake)', file=sys.stderr)
            sys.exit(1)
        if trigger in line and mode == "hang":
            time.sleep(3600)
        if trigger in line and mode == "garbage":
            print("Error: specify hypothesis and at least one reference", flush=True)
            continue
        print(f"{len(fields[-1]) + 0.5} {len(fields) - 2}.0", flush=True)
    elif fields[0] == "EVAL":
        sums = [sum(float(x) for x in stats.split()) for stats in fields[1:]]
        print("".join(f"{s}\n" for s in sums) + f"{sum(sums)}", flush=True)
