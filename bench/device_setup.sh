# Sourced by the device scripts (run_device.sh, weights_device.sh) from the repo root: the carried wheels (.whl,
# bench/fetch_device_wheels.sh) and the package installed, $OUT made, the environment that finds them.
OUT=${OUT:-/tmp/ua-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 UACOMPILE_CACHE_DIR=${UACOMPILE_CACHE_DIR:-/tmp/ua-cache}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# install the package itself (setup.cfg maps runtime/, targets/, templates/ into uacompile); no build
# isolation: the device reaches no index, and its Python has setuptools
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/pkg . || exit 1
# PYTHONSAFEPATH: the repo root (whose uacompile/ lacks the mapped folders) never shadows the install
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONSAFEPATH=1
