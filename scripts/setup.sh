#!/usr/bin/env bash
# Create .venv with the pinned TorchRec stack that loads together (see docs/ and REFERENCE: the fbgemm C++ ABI
# must match torch's minor version). Idempotent: a finished install leaves a stamp and is not repeated.
set -euo pipefail
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.herald-setup-v1"
if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import fbgemm_gpu, torchrec" 2>/dev/null; then
  exit 0
fi
echo "[setup] creating $VENV (torch 2.13.0, fbgemm-gpu 1.8.0, torchrec 1.8.0) ..."
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip setuptools wheel
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FBGEMM=fbgemm-gpu==1.8.0; echo "[setup] CUDA detected: using the CUDA builds"
  pip install -q torch==2.13.0 "$FBGEMM"
else
  FBGEMM=fbgemm-gpu-cpu==1.8.0
  pip install -q torch==2.13.0 "$FBGEMM"
fi
# torchrec's real requirements, then torchrec itself without its fbgemm-gpu (CUDA) dependency
pip install -q tensordict tqdm pyre-extensions iopath "torchmetrics==1.0.3"
pip install -q --no-deps torchrec==1.8.0
pip install -q "hydra-core>=1.3,<1.4" tensorboard pytest matplotlib
pip install -q --no-deps -e .
if ! "$VENV/bin/python" -c "import torch, fbgemm_gpu, torchrec; print('[setup] ok: torch', torch.__version__, '| torchrec', torchrec.__version__)"; then
  echo "[setup] ERROR: the installed stack does not import (torch / fbgemm_gpu / torchrec)." >&2
  echo "[setup] fbgemm must match torch's minor version (torch 2.13 <-> fbgemm 1.8). Remove $VENV and retry." >&2
  exit 1
fi
touch "$STAMP"
