# The newcomer gather (engine: a request from another client than the last to end waits a quiet gap,
# arrival_wait / 12) on the CPU demo: main (b149fab5's lily) against newcomer-gather, 8 clients and
# 1 client, two rounds each, with each run's prefill passes (part counts), gathers
# (gathered/expected@waited_us, newcomer flag) and summary line. Prefill budget 4,096 so that a gathered
# round is one pass, as session 46's runs. Paths are the session's.
cd /work/main
for round in 1 2; do for b in main ng; do for n in 8 1; do
  RUST_LOG=lily_engine=debug /work/ab48/lily-$b serve --bind 127.0.0.1:18300 --max-concurrent 8 --prefill-chunk 4096 > /work/ab48/n-$b-$n-$round.log 2>&1 & pid=$!
  for i in $(seq 50); do curl -s 127.0.0.1:18300/v1/models >/dev/null && break; sleep 0.2; done
  python3 scripts/serve_bench.py --base-url http://127.0.0.1:18300 --clients $n --requests-per-client 4 --max-tokens 32 --json /work/ab48/n-$b-$n-$round.json > /work/ab48/n-$b-$n-$round.txt 2>&1
  kill -9 $pid; wait $pid 2>/dev/null
  L=/work/ab48/n-$b-$n-$round.log
  echo "$b clients=$n round $round passes(parts): $(sed 's/\x1b\[[0-9;]*m//g' $L | grep -a 'prefill pass' | grep -a -o 'parts=[0-9]*' | cut -d= -f2 | tr '\n' ' ')| gathers: $(sed 's/\x1b\[[0-9;]*m//g' $L | grep -a 'held the first prefill' | grep -a -o 'gathered=[0-9]* expected=[0-9]*\( newcomer=[a-z]*\)\? waited_us=[0-9]*' | sed 's/gathered=//;s/ expected=/\//;s/ newcomer=/ n=/;s/ waited_us=/@/' | tr '\n' ' ')| $(tail -1 /work/ab48/n-$b-$n-$round.txt)"
done; done; done
