#!/usr/bin/env bash
# Runs the cargo-fuzz targets one after the other, one libFuzzer process each (no -jobs, no
# -fork: one core), for SECONDS each, and prints a table of executions per target.
#
#   fuzz/run.sh SECONDS [TARGET...]      (default: every target)
#
# Called by `make fuzz-smoke` (part of `make test`) and `make fuzz`; see docs/fuzzing.md.
# Needs the nightly toolchain and cargo-fuzz on PATH (the Makefile installs it pinned into
# .cache/cargo-fuzz). Exits non-zero if any target finds a crash (a panic, a failed
# assertion, an input slower than FUZZ_TIMEOUT seconds, or more memory than libFuzzer's
# default 2 GiB); the input is then in fuzz/artifacts/TARGET/ and the log in
# fuzz/target/logs/TARGET.log. New corpus inputs go to fuzz/corpus/TARGET (not committed);
# the committed seeds in fuzz/seeds/TARGET are read, never written.
#
# Environment: FUZZ_TOOLCHAIN (nightly), FUZZ_SANITIZER (none; `address` for ASan),
# FUZZ_TIMEOUT (30, seconds per input), FUZZ_ARGS (extra libFuzzer flags).
set -euo pipefail

cd "$(dirname "$0")/.."
root=$PWD

seconds=${1:?usage: fuzz/run.sh SECONDS [TARGET...]}
shift
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(request_parser sse_scanner config_loader units)
fi
toolchain=${FUZZ_TOOLCHAIN:-nightly}
sanitizer=${FUZZ_SANITIZER:-none}
timeout=${FUZZ_TIMEOUT:-30}
read -r -a extra <<<"${FUZZ_ARGS:-}"

if ! cargo "+$toolchain" --version >/dev/null 2>&1; then
  echo "fuzz: cargo-fuzz needs the $toolchain Rust toolchain (rustup toolchain install $toolchain)" >&2
  exit 1
fi
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "fuzz: cargo-fuzz is not on PATH (make fuzz-deps installs it into .cache/cargo-fuzz)" >&2
  exit 1
fi

# The fuzz crate is outside the workspace, so `cargo fmt --all` does not see it.
cargo fmt --manifest-path fuzz/Cargo.toml -- --check

fuzz=(cargo "+$toolchain" fuzz)
build_flags=(--sanitizer "$sanitizer" --target-dir "$root/fuzz/target")
bin_dir=$root/fuzz/target/$(rustc "+$toolchain" -vV | sed -n 's/^host: //p')/release
mkdir -p fuzz/target/logs
echo "fuzz: building the targets (sanitizer: $sanitizer; log: fuzz/target/logs/build.log)"
if ! "${fuzz[@]}" build "${build_flags[@]}" >fuzz/target/logs/build.log 2>&1; then
  tail -n 40 fuzz/target/logs/build.log >&2
  echo "fuzz: the build failed" >&2
  exit 1
fi

failed=()
rows=()
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t"
  log="fuzz/target/logs/$t.log"
  echo "fuzz: $t for ${seconds}s (log: $log)"
  mkdir -p "fuzz/artifacts/$t"
  status=0
  # The binary `cargo fuzz run` would start, started directly: no rebuild between targets.
  "$bin_dir/$t" -artifact_prefix="$root/fuzz/artifacts/$t/" \
    -max_total_time="$seconds" -timeout="$timeout" -dict="$root/fuzz/dicts/$t.dict" \
    -print_final_stats=1 "${extra[@]}" \
    "$root/fuzz/corpus/$t" "$root/fuzz/seeds/$t" >"$log" 2>&1 || status=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  corpus=$(find "fuzz/corpus/$t" -type f | wc -l)
  if [ "$status" -ne 0 ]; then
    failed+=("$t")
    echo "fuzz: $t FAILED (exit $status); the end of $log:" >&2
    tail -n 40 "$log" >&2
    rows+=("$(printf '%-16s %14s %10s %8s  %s' "$t" "${execs:--}" "${speed:--}" "$corpus" "CRASH")")
  else
    rows+=("$(printf '%-16s %14s %10s %8s  %s' "$t" "${execs:--}" "${speed:--}" "$corpus" "ok")")
  fi
done

echo
printf '%-16s %14s %10s %8s  %s\n' target executions "exec/s" corpus result
printf '%s\n' "${rows[@]}"
if [ ${#failed[@]} -ne 0 ]; then
  echo "fuzz: crashes in: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
  exit 1
fi
