# Sourced by the device scripts: installs the carried wheels (the GPU image lacks them) and
# sets the environment every run there needs. Results go under $OUT. The wheels are read
# from $WHEELS, else .whl here, else ../.whl (a checkout copied into a folder of another).
OUT=${OUT:-/tmp/tandem_out}
mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}
[ -d "$WHEELS" ] || WHEELS=../.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
