# Session 61: whichever card comes (c61a.tar.xz): devrun-2.sh on an H200 (tests, A/B, serving, contract),
# devrun-1.sh elsewhere (tests and A/B on the H100).
case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in
  *H200*) bash docs/perf/2026-12-06-s61/devrun-2.sh ;;
  *) bash docs/perf/2026-12-06-s61/devrun-1.sh ;;
esac
