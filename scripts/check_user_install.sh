#!/usr/bin/env bash
# A user's install on a fresh machine, for real: `pip install .` and `pip install ".[attention]"`
# into a clean Python 3.12 venv, then the package run from there (scripts/user_install_smoke.py).
# `make check-user-install` runs it; so does CI (.ci/run).
#
# 1. The source: what a clone has (tracked files, and new ones git does not ignore), copied to a
#    temp dir, so no build output of the checkout (build/, *.egg-info, .so) slips in.
# 2. A fresh venv on Python 3.12 with the pip it ships (no upgrade, nothing else installed):
#    `pip install --dry-run --report` of `.` and of `.[attention]` must resolve, and the reports
#    must hold megatron-core >= 0.19.2 and torch, and the cuDNN frontend only with the extra.
# 3. An interpreter below 3.12 (python3, the CI machines' 3.11) must be refused by pip for
#    Requires-Python: python_requires says what megatron-core needs (skipped when python3 is
#    3.12 or later).
# 4. `pip install .` for real (no pip cache: everything downloaded as on a fresh machine, a CUDA
#    torch from PyPI, ~3 GB of wheels, ~5.5 GB installed), `pip check`, then the smoke run from
#    outside the source tree: import from the venv, a one-rank gather, a tiny GPTModel at CP 1
#    and CP 2 on gloo.
# 5. `pip install ".[attention]"` over it, `pip check`, and the smoke again with the cuDNN
#    frontend loaded.
# The temp dir (venv included) is removed at the end. Times of each step are printed.
#
# Env: PYTHON312 (default: pyenv's newest 3.12, else python3.12 on PATH), PYTHON_OLD (default
# python3), KEEP_USER_VENV=1 keeps the temp dir.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

die() { echo "check_user_install: $*" >&2; exit 1; }

find_python312() {
  if [[ -n "${PYTHON312:-}" ]]; then echo "$PYTHON312"; return; fi
  # pyenv's interpreter itself (its python3.12 shim fails unless 3.12 is the selected version).
  local pyenv_root found
  pyenv_root="$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")"
  found="$(ls -d "$pyenv_root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -n 1)"
  if [[ -n "$found" ]]; then echo "$found"; return; fi
  if python3.12 -c '' >/dev/null 2>&1; then command -v python3.12; return; fi
  return 1
}

py312="$(find_python312)" || die "no Python 3.12 found (set PYTHON312)"
"$py312" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' ||
  die "$py312 is not Python 3.12"
py_old="${PYTHON_OLD:-python3}"

work="$(mktemp -d)"
if [[ "${KEEP_USER_VENV:-0}" == 1 ]]; then
  echo "== keeping $work"
else
  trap 'rm -rf "$work"' EXIT
fi
src="$work/src"
mkdir "$src"

t0=$(date +%s)
step_start=$t0
timing=()
step() {
  local now
  now=$(date +%s)
  timing+=("$(printf '%-42s %4d s' "$1" $((now - step_start)))")
  step_start=$now
}

# 1. What a clone has.
git -C "$root" rev-parse --git-dir >/dev/null 2>&1 || die "$root is not a git checkout"
(cd "$root" && git ls-files -z -co --exclude-standard) |
  (cd "$root" && xargs -0 -r sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' _) |
  tar -C "$root" --null -T - -cf - | tar -C "$src" -xf -
[[ -f "$src/setup.py" ]] || die "the copy of the checkout has no setup.py"

# 2. Resolution on a fresh 3.12 venv.
venv="$work/venv"
"$py312" -m venv "$venv"
vpy="$venv/bin/python"
echo "== fresh venv: $("$vpy" --version), $("$vpy" -m pip --version | cut -d' ' -f1-2)"
pip=("$vpy" -m pip --disable-pip-version-check)
# Runs a command, printing its output after it ends less the lines of local index folders that
# this machine's pip configuration names and that hold nothing for this package set.
quiet() {
  local status=0
  "$@" >"$work/out.log" 2>&1 || status=$?
  grep -v "is ignored: it is neither a file nor a directory" "$work/out.log" || true
  return $status
}
for target in "." ".[attention]"; do
  report="$work/report-${target//[^a-z]/}.json"
  echo "== pip install --dry-run \"$target\" (Python 3.12)"
  (cd "$src" && quiet "${pip[@]}" install -q --dry-run --ignore-installed --report "$report" "$target")
done
"$vpy" - "$work/report-.json" "$work/report-attention.json" <<'EOF'
import json
import sys


def resolved(path):
    with open(path) as f:
        return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(f)["install"]}


plain, attention = (resolved(p) for p in sys.argv[1:])
for name, got in (("plain", plain), ("attention", attention)):
    core = got.get("megatron-core")
    assert core and tuple(int(x) for x in core.split(".")[:3]) >= (0, 19, 2), (name, core)
    assert "torch" in got and "megatron-context-parallel" in got, (name, sorted(got))
assert "nvidia-cudnn-frontend" not in plain, plain
assert "nvidia-cudnn-frontend" in attention, sorted(attention)
print(f"   .: {len(plain)} distributions (torch {plain['torch']}, megatron-core "
      f"{plain['megatron-core']}); .[attention]: + nvidia-cudnn-frontend "
      f"{attention['nvidia-cudnn-frontend']} and {len(attention) - len(plain) - 1} more")
EOF
step "resolution of . and .[attention] (3.12)"

# 3. Below 3.12: refused.
if "$py_old" -c 'import sys; sys.exit(sys.version_info >= (3, 12))' 2>/dev/null; then
  old_venv="$work/venv-old"
  "$py_old" -m venv "$old_venv"
  echo "== pip install --dry-run . on $("$old_venv/bin/python" --version) must be refused"
  set +e
  refusal="$(cd "$src" && "$old_venv/bin/python" -m pip install --disable-pip-version-check \
    --dry-run --no-deps . 2>&1)"
  rc=$?
  set -e
  if [[ $rc -eq 0 ]] || ! grep -q "requires a different Python" <<<"$refusal"; then
    echo "$refusal" >&2
    die "pip on $("$old_venv/bin/python" --version) did not refuse the package for Requires-Python"
  fi
  grep "requires a different Python" <<<"$refusal" | sed 's/^/   /'
  rm -rf "$old_venv"
  step "refusal below 3.12"
else
  echo "== $py_old is 3.12 or later: the refusal check is skipped"
fi

# 4. The real install.
echo "== pip install . (Python 3.12, fresh venv, no cache)"
(cd "$src" && quiet "${pip[@]}" install -q --no-cache-dir .)
"${pip[@]}" check
echo "   installed: $(du -sh "$venv" | cut -f1) in the venv"
step "pip install . (real)"
(cd "$work" && PYTHONWARNINGS=ignore "$vpy" "$src/scripts/user_install_smoke.py")
step "smoke after pip install ."

# 5. The attention extra.
echo "== pip install \".[attention]\""
(cd "$src" && quiet "${pip[@]}" install -q --no-cache-dir ".[attention]")
"${pip[@]}" check
step "pip install .[attention] (real)"
(cd "$work" && PYTHONWARNINGS=ignore "$vpy" "$src/scripts/user_install_smoke.py" --attention)
step "smoke with the attention extra"

echo "== user install check: OK ($(($(date +%s) - t0)) s)"
printf '   %s\n' "${timing[@]}"
