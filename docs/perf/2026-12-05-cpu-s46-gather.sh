# The 8-client runs of docs/perf/2026-12-05-cpu-s46-prompt-prep.txt (CPU demo, prefill budget 4,096 so
# that a gathered round is one pass): each binary in turn, two rounds; prints the prefill passes' part
# counts, each gather (gathered[/expected]@waited_us) and the summary line. Paths are the session's.
cd /work/main
for round in 1 2; do for b in base split burst; do
  RUST_LOG=lily_engine=debug,lily_server=debug /work/bins/lily-$b serve --bind 127.0.0.1:18300 --max-concurrent 8 --prefill-chunk 4096 > /work/ab/g-$b-$round.log 2>&1 & pid=$!
  for i in $(seq 50); do curl -s 127.0.0.1:18300/v1/models >/dev/null && break; sleep 0.2; done
  python3 scripts/serve_bench.py --base-url http://127.0.0.1:18300 --clients 8 --requests-per-client 4 --max-tokens 32 > /work/ab/g-$b-$round.txt 2>&1
  kill -9 $pid; wait $pid 2>/dev/null
  L=/work/ab/g-$b-$round.log
  echo "$b $round passes(parts): $(sed 's/\x1b\[[0-9;]*m//g' $L | grep -a 'prefill pass' | grep -a -o 'parts=[0-9]*' | cut -d= -f2 | tr '\n' ' ')| gathers: $(sed 's/\x1b\[[0-9;]*m//g' $L | grep -a 'held the first prefill' | grep -a -o 'gathered=[0-9]*\( expected=[0-9]*\)\? waited_us=[0-9]*' | sed 's/gathered=//;s/ expected=/\//;s/ waited_us=/@/' | tr '\n' ' ')| $(tail -1 /work/ab/g-$b-$round.txt)"
done; done
