#!/usr/bin/env bash
# Create .venv with the pinned TorchRec stack that loads together (see docs/ and REFERENCE: the fbgemm C++ ABI
# must match torch's minor version). Idempotent: a finished install leaves a stamp and is not repeated.
set -euo pipefail
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.herald-setup-v1"
if [ -f "$STAMP" ] && [ -x "$VENV/bin/ruff" ] && "$VENV/bin/python" -c "import fbgemm_gpu, torchrec" 2>/dev/null; then
  exit 0
fi
# torch minor -> fbgemm-gpu / torchrec minor (docs: REFERENCE "The stack"); the fbgemm C++ ABI must match torch's
stack_for() {
  case "$1" in
    2.11) echo 1.6 ;; 2.12) echo 1.7 ;; 2.13) echo 1.8 ;; 2.14) echo 1.9 ;;
    *) echo "[setup] ERROR: no known fbgemm-gpu / torchrec for torch $1 (supported: 2.11 .. 2.14)" >&2; return 1 ;;
  esac
}
pip() { "$VENV/bin/python" -m pip "$@"; }
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  # CUDA: keep the machine's own CUDA torch if it has one (reinstalling pulls GBs), and match the stack to its minor
  TORCH_MINOR=$("$PY" -c "import torch; print('.'.join(torch.__version__.split('.')[:2]))" 2>/dev/null || true)
  if [ -n "$TORCH_MINOR" ]; then
    STACK=$(stack_for "$TORCH_MINOR")
    echo "[setup] CUDA detected, torch $TORCH_MINOR installed: using fbgemm-gpu / torchrec $STACK"
    [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
    pip install -q --upgrade pip setuptools wheel
    pip install -q "fbgemm-gpu==$STACK.*"
  else
    STACK=1.8
    echo "[setup] CUDA detected, no torch: installing torch 2.13.0 + fbgemm-gpu / torchrec $STACK"
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    pip install -q --upgrade pip setuptools wheel
    pip install -q torch==2.13.0 "fbgemm-gpu==$STACK.*"
  fi
else
  STACK=1.8
  echo "[setup] creating $VENV (torch 2.13.0, fbgemm-gpu-cpu 1.8.0, torchrec 1.8.0) ..."
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  pip install -q --upgrade pip setuptools wheel
  pip install -q torch==2.13.0 fbgemm-gpu-cpu==1.8.0
fi
# torchrec's real requirements, then torchrec itself without its fbgemm-gpu dependency (on CPU: the CUDA build)
pip install -q tensordict tqdm pyre-extensions iopath "torchmetrics==1.0.3"
pip install -q --no-deps "torchrec==$STACK.*"
pip install -q "hydra-core>=1.3,<1.4" tensorboard pytest matplotlib "ruff==0.17.6"  # ruff: make test's format + lint check
pip install -q --no-deps -e .
if ! "$VENV/bin/python" -c "import torch, fbgemm_gpu, torchrec; print('[setup] ok: torch', torch.__version__, '| torchrec', torchrec.__version__)"; then
  echo "[setup] ERROR: the installed stack does not import (torch / fbgemm_gpu / torchrec)." >&2
  echo "[setup] fbgemm must match torch's minor version (2.11<->1.6 ... 2.13<->1.8 ... 2.14<->1.9). Remove $VENV and retry." >&2
  exit 1
fi
# the compiled kernels (herald_torchrec/_native.py builds them on first use otherwise; without a C++ compiler Herald
# runs its numpy code: the same results, more CPU per step)
"$VENV/bin/python" -c "from herald_torchrec.schedule import native; from herald_torchrec.distributed import host_kernels as s; print('[setup] compiled kernels:', native.KERNELS.build(), s.KERNELS.build())" \
  || echo "[setup] note: the compiled kernels did not build (no C++ compiler?); Herald will use its numpy code" >&2
touch "$STAMP"
