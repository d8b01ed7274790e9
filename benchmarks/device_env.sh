# Sourced by the device scripts: installs the carried wheels (the GPU image lacks them) and
# sets the environment every run there needs. Results go under $OUT.
OUT=${OUT:-/tmp/tandem_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
