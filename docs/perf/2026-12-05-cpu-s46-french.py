# The French-prompt runs of docs/perf/2026-12-05-cpu-s46-prompt-prep.txt: 10 chat requests of ~1.1 KB of
# accented French (random words, seed argv[2]), 16 output tokens each, one after another, to the server
# on port argv[1]; the server's debug log gives each one's since_arrival_us.
import json, random, sys, urllib.request
random.seed(int(sys.argv[2]))
words = "le la les des une été où déjà très français élève cœur naïve garçon château fenêtre".split()
for i in range(10):
    text = f"Demande {i}.\n" + " ".join(random.choice(words) for _ in range(180))
    body = json.dumps({"model": "lily", "messages": [{"role": "user", "content": text}], "max_tokens": 16}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions", body, {"Content-Type": "application/json"})
    urllib.request.urlopen(req).read()
print(len(text.encode()), "bytes a prompt")
