#!/usr/bin/env bash
# Installs megatron-core and this package into an existing PyTorch environment, without ever
# replacing the environment's torch, TransformerEngine, apex or flash-attn.
#
# The Dockerfile runs it in the NGC image, and scripts/install_dev.sh (the development and CI
# install) runs it into .venv; it runs just as well on a bare GPU machine. Both installs use
# --no-deps (the base environment already holds torch, numpy and packaging) and the package is
# built with --no-build-isolation (against the torch that is there, never a freshly downloaded
# one). The versions of the protected distributions are read before and after; any change fails
# the script.
#
# Usage: docker/install.sh [options]
#   --python PY            interpreter to install into (default: $PYTHON, else python3)
#   --megatron-core SPEC   requirement for megatron-core (default: megatron-core==0.19.2)
#   --wheel-dir DIR        install megatron-core from wheels in DIR only (no index; offline)
#   --skip-megatron-core   do not install megatron-core (already there, or not wanted)
#   --require-cuda         build the CUDA extension or fail (MCP_FORCE_CUDA_BUILD=1)
#   --no-cuda              pure-Python install (MCP_SKIP_CUDA_BUILD=1)
#   --editable             editable install (development checkouts)
#   --extras LIST          also install these extras' requirements (comma-separated, e.g.
#                          attention), read from the installed package's metadata, with their
#                          own dependencies but the protected versions pinned
#   -h, --help             this text
# Without --require-cuda / --no-cuda, setup.py decides (torch with CUDA and nvcc -> build).
# TORCH_CUDA_ARCH_LIST defaults to 9.0 (H100 / H200).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"

python="${PYTHON:-python3}"
mcore_spec="megatron-core==0.19.2"
wheel_dir=""
skip_mcore=0
cuda_mode="auto"
editable=0
extras=""

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "install.sh: $*" >&2; exit 1; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) python="${2:?--python needs a value}"; shift 2 ;;
    --megatron-core) mcore_spec="${2:?--megatron-core needs a value}"; shift 2 ;;
    --wheel-dir) wheel_dir="${2:?--wheel-dir needs a value}"; shift 2 ;;
    --skip-megatron-core) skip_mcore=1; shift ;;
    --require-cuda) cuda_mode="require"; shift ;;
    --no-cuda) cuda_mode="skip"; shift ;;
    --editable) editable=1; shift ;;
    --extras) extras="${2:?--extras needs a value}"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

command -v "$python" >/dev/null 2>&1 || [[ -x "$python" ]] || die "python not found: $python"
[[ -z "$wheel_dir" || -d "$wheel_dir" ]] || die "--wheel-dir $wheel_dir is not a directory"

export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
case "$cuda_mode" in
  require) export MCP_FORCE_CUDA_BUILD=1; unset MCP_SKIP_CUDA_BUILD ;;
  skip) export MCP_SKIP_CUDA_BUILD=1; unset MCP_FORCE_CUDA_BUILD ;;
  auto) ;;
esac

# torch must already be there: without it pip would have to fetch one, which is the thing this
# script exists to prevent.
"$python" -c 'import torch' 2>/dev/null ||
  die "$python cannot import torch; install this into an environment that has PyTorch"

before="$("$python" "$here/protected_versions.py")"
echo "== protected distributions (left as they are):"
echo "$before" | sed 's/^/   /'

pip=("$python" -m pip install --no-deps --no-cache-dir --disable-pip-version-check)
# megatron-core 0.19.2 declares Requires-Python >= 3.12 but runs on 3.11 (the CPU CI machines').
mcore_pip=("${pip[@]}" --ignore-requires-python)

if [[ $skip_mcore -eq 1 ]]; then
  echo "== megatron-core: skipped (--skip-megatron-core)"
elif [[ -n "$wheel_dir" ]]; then
  echo "== megatron-core: $mcore_spec from $wheel_dir (no index)"
  "${mcore_pip[@]}" --no-index --find-links "$wheel_dir" "$mcore_spec"
else
  echo "== megatron-core: $mcore_spec"
  "${mcore_pip[@]}" "$mcore_spec"
fi

# The package declares Requires-Python >= 3.12 (megatron-core's); below 3.12 (the CPU CI
# machines' 3.11, the development path) it is installed all the same, like megatron-core.
pkg_pip=("${pip[@]}" --no-build-isolation)
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  echo "== Python below 3.12: megatron-context-parallel with --ignore-requires-python (development)"
  pkg_pip+=(--ignore-requires-python)
fi

echo "== megatron-context-parallel from $root (cuda: $cuda_mode, arch list $TORCH_CUDA_ARCH_LIST)"
if [[ $editable -eq 1 ]]; then
  "${pkg_pip[@]}" -e "$root"
else
  "${pkg_pip[@]}" "$root"
fi

if [[ -n "$extras" ]]; then
  # --no-deps above dropped the extras' requirements too; setup.py names them, the metadata
  # carries them. They come with their dependencies, the protected versions held as they are.
  reqs_text="$("$python" "$here/extra_requirements.py" megatron-context-parallel "$extras")"
  extra_reqs=()
  [[ -z "$reqs_text" ]] || mapfile -t extra_reqs <<<"$reqs_text"
  echo "== extras $extras: ${extra_reqs[*]:-(none)}"
  if [[ ${#extra_reqs[@]} -gt 0 ]]; then
    held="$(mktemp)"
    [[ "$before" == "(none installed)" ]] || echo "$before" >"$held"
    "$python" -m pip install --no-cache-dir --disable-pip-version-check --constraint "$held" \
      "${extra_reqs[@]}"
    rm -f "$held"
  fi
fi

after="$("$python" "$here/protected_versions.py")"
if [[ "$before" != "$after" ]]; then
  echo "install.sh: a protected distribution changed during the install:" >&2
  diff <(echo "$before") <(echo "$after") >&2 || true
  exit 1
fi
echo "== install.sh: done (protected distributions unchanged)"
