#!/usr/bin/env bash
# Mutation testing (mutmut 3) of the scheduler core, the sampler and the detokenizer.
#
#   benchmarks/mutation.sh [MODULE...]     MODULE: scheduler | sampler | detokenizer | report
#
# With no MODULE it runs all three, then prints the report: per module the mutants
# killed (a test failed or timed out) out of all mutants, the surviving mutants, and the
# score over the non-equivalent ones. Equivalent mutants (no observable change) are
# listed with a reason in docs/benchmarks.md, section "Mutation testing"; the report
# reads their names from there. `report` only prints the report of the last runs.
#
# It builds its own virtualenv (.venv-mutation in the checkout, or $MUTATION_VENV) with
# the project, its test extras, the CPU build of torch and mutmut, and works in
# mutants/ (mutmut's copy of the project). Both are git-ignored. Environment:
#   MUTATION_VENV   virtualenv path (default .venv-mutation)
#   MUTATION_JOBS   mutants tested in parallel (default: the number of cores)
#   MUTATION_KEEP=1 keep mutants/ and the results of earlier runs (default: start over)
#   MUTATION_DIFFS=1 print the diff of every surviving mutant in the report
#
# mutmut is configured in pyproject.toml ([tool.mutmut]): the files mutated and the fast
# test files run against them. Mutants are tested only with the tests that reach the
# mutated function (mutmut's per-function test selection).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${MUTATION_VENV:-.venv-mutation}
JOBS=${MUTATION_JOBS:-$(nproc 2>/dev/null || echo 2)}
PYTHON=${PYTHON:-python3}

setup_venv() {
    # Rebuilt (pip is quick when everything is there) whenever pyproject.toml changed.
    local stamp="$VENV/.expeditor-mutation"
    local want
    want="mutmut>=3.8,<4 torch==2.13.0 $(sha256sum pyproject.toml | cut -c1-16)"
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        return
    fi
    echo "== building $VENV" >&2
    [[ -x "$VENV/bin/pip" ]] || "$PYTHON" -m venv "$VENV"
    # torch pinned first: a bare "torch" could resolve to a multi-GB CUDA build.
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q -e '.[test]' 'mutmut>=3.8,<4'
    echo "$want" >"$stamp"
}

# mutmut names a mutant module.path.xǁClassǁmethod__mutmut_N (x_function__mutmut_N).
declare -A GLOBS=(
    [scheduler]="scheduler_svc.core.scheduler.* scheduler_svc.core.kv_manager.* scheduler_svc.core.block_pool.* scheduler_svc.core.policies.* scheduler_svc.core.queues.* scheduler_svc.core.ngram.* scheduler_svc.core.speculation.*"
    [sampler]="gpu_worker.sampler.* gpu_worker.logits_shaping.* gpu_worker.prompt_logprobs.*"
    [detokenizer]="scheduler_svc.detokenizer.*"
)

run_module() {
    local module=$1
    local globs
    read -r -a globs <<<"${GLOBS[$module]}"
    local log="mutants/mutmut-$module.log"
    mkdir -p mutants
    echo "== mutmut run ($module, $JOBS jobs; output in $log)" >&2
    # The exit status says little (surviving mutants are not an error for mutmut);
    # a run that tested nothing shows in the report as "not run". Mutants run in
    # processes forked from mutmut's: torch's OpenMP thread pool does not survive a
    # fork (the sampler's tests hang and time out), so one thread each.
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TRITON_INTERPRET=1 \
        "$VENV/bin/mutmut" run --max-children "$JOBS" "${globs[@]}" \
        >"$log" 2>&1 || echo "   mutmut exited with status $? (see $log)" >&2
    grep -a -o '[0-9.]* mutations/second' "$log" | tail -1 >&2 || true
}

report() {
    "$PYTHON" - "${MUTATION_DIFFS:-0}" "$VENV/bin/mutmut" <<'PY'
import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

show_diffs = sys.argv[1] == "1"
mutmut = sys.argv[2]
MODULES = {
    "scheduler core": [
        "scheduler_svc/core/scheduler.py",
        "scheduler_svc/core/kv_manager.py",
        "scheduler_svc/core/block_pool.py",
        "scheduler_svc/core/policies.py",
        "scheduler_svc/core/queues.py",
        "scheduler_svc/core/ngram.py",
    "scheduler_svc/core/speculation.py",
    ],
    "sampler": ["gpu_worker/sampler.py", "gpu_worker/logits_shaping.py", "gpu_worker/prompt_logprobs.py"],
    "detokenizer": ["scheduler_svc/detokenizer.py"],
}
KILLED = {1: "killed", 3: "killed", 36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout"}
SURVIVED = {0: "survived"}

# Equivalent mutants: backticked names on list lines of the docs' "Mutation testing" section.
docs = Path("docs/benchmarks.md").read_text() if Path("docs/benchmarks.md").exists() else ""
section = docs.split("\n## Mutation testing", 1)[1] if "\n## Mutation testing" in docs else ""
section = section.split("\n## ", 1)[0]
equivalent = set(re.findall(r"^\s*- `([\w.ǁ]+__mutmut_\d+)`", section, flags=re.M))

total_all = killed_all = 0
for module, files in MODULES.items():
    counts: dict[str, int] = defaultdict(int)
    survivors: list[str] = []
    per_file = []
    for name in files:
        meta = Path("mutants") / (name + ".meta")
        if not meta.exists():
            per_file.append(f"{name}: not run")
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        file_killed = 0
        for key, code in codes.items():
            if code in KILLED:
                counts["killed"] += 1
                file_killed += 1
            elif code in SURVIVED:
                counts["survived"] += 1
                survivors.append(key)
            elif code is None:
                counts["not checked"] += 1
            elif code in (5, 33):
                counts["no tests"] += 1
                survivors.append(key)
            else:
                counts[f"other ({code})"] += 1
                survivors.append(key)
        per_file.append(f"{name}: {file_killed}/{len(codes)} killed")
    total = sum(counts.values())
    if not total or counts["not checked"] == total:
        print(f"\n{module}: not run")
        continue
    equiv = [s for s in survivors if s in equivalent]
    live = [s for s in survivors if s not in equivalent]
    scored = total - len(equiv) - counts["not checked"]
    score = 100.0 * counts["killed"] / scored if scored else 0.0
    print(f"\n{module}: {counts['killed']}/{total} killed, {len(equiv)} equivalent; "
          f"score {score:.1f}% of non-equivalent mutants")
    print("  " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for line in per_file:
        print(f"  {line}")
    for key in live:
        print(f"  SURVIVED {key}")
        if show_diffs:
            diff = subprocess.run([mutmut, "show", key], capture_output=True, text=True).stdout
            print("    " + "\n    ".join(diff.strip().splitlines()))
    for key in equiv:
        print(f"  equivalent {key}")
PY
}

main() {
    local modules=("$@")
    if [[ ${#modules[@]} -eq 0 ]]; then
        modules=(scheduler sampler detokenizer)
    fi
    if [[ "${modules[*]}" != "report" ]]; then
        setup_venv
        if [[ "${MUTATION_KEEP:-0}" != "1" ]]; then
            rm -rf mutants
        fi
        for module in "${modules[@]}"; do
            if [[ -z "${GLOBS[$module]:-}" ]]; then
                echo "unknown module $module (scheduler, sampler, detokenizer, report)" >&2
                exit 2
            fi
            run_module "$module"
            MUTATION_KEEP=1 # later modules add to this run's results
        done
    fi
    echo "== mutation score ($(date -u +%F), $(nproc 2>/dev/null || echo '?') cores)"
    report
}

main "$@"
