#!/usr/bin/env bash
# TransferQueue 0.1.11's own public-API tests and its tutorials 01-05, run on rlferry's shim
# (rlferry.compat.transferqueue) instead of TransferQueue. Nothing of theirs is kept in this
# repository: the wheel is downloaded and unpacked outside the source tree, its package is
# removed (so `import transfer_queue` can only be the shim), our conftest supplies the fixtures
# that started Ray, and the tests run unchanged.
#
#   bash tests/tq_upstream/run.sh          # with the venv of rlferry's [dev] extra, plus ray
#
# Needs `ray` importable: their test modules and tutorials `import ray`; the tutorials and their
# KV module run on a local Ray, where the shim's state is a named actor of the job (the other
# modules run it embedded). TQ_UPSTREAM_DIR picks the work directory.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ -n "${TQ_UPSTREAM_DIR:-}" ]; then
  work="$TQ_UPSTREAM_DIR"
else
  work="$(mktemp -d -t tq-upstream-XXXXXX)"
  trap 'rm -rf "$work"' EXIT
fi
case "$work" in "$(cd "$here/../.." && pwd)"/*)
  echo "TQ_UPSTREAM_DIR: expected a directory outside the source tree, got $work" >&2; exit 2;;
esac
# Their ray.init() attaches to any Ray already running on the machine: start a local one.
export RAY_ADDRESS=local
python -c "import ray" 2>/dev/null || {
  echo "tests/tq_upstream: their tests import ray: pip install ray" >&2; exit 2; }
rm -rf "$work/wheel" "$work/src"
pip download -q --no-deps transferqueue==0.1.11 -d "$work/wheel"
python -m zipfile -e "$work"/wheel/transferqueue-0.1.11-*.whl "$work/src"
rm -rf "$work/src/transfer_queue" "$work"/src/transferqueue-*.dist-info
cp "$here/upstream_conftest.py" "$work/src/tests/conftest.py"
python "$here/prepare.py" "$work/src/tests"

# Left out, each for its reason (only tests that read TransferQueue's controller actor or
# storage internals).
kv=tests/e2e/test_kv_interface_e2e.py
deselect=(
  # reads TransferQueue's StorageUnitData (a SimpleStorage storage-unit internal)
  --deselect tests/test_metadata.py::TestStorageUnitDataStrict
  # these read the controller actor's partition snapshot (DataPartitionStatus internals)
  --deselect "$kv::TestKVPutE2E::test_kv_put_single_sample_with_fields_and_tag"
  --deselect "$kv::TestKVPutE2E::test_kv_put_update_tag_only"
  --deselect "$kv::TestKVPutE2E::test_kv_put_partial_update"
  --deselect "$kv::TestKVBatchPutE2E::test_kv_batch_put_multiple_samples"
  --deselect "$kv::TestKVBatchPutE2E::test_kv_batch_put_partial_update"
  --deselect "$kv::TestKVClearE2E::test_kv_clear_single_key"
  --deselect "$kv::TestKVClearE2E::test_kv_clear_idempotent"
  --deselect "$kv::TestKVE2ECornerCases::test_field_expansion_across_samples"
)
cd "$work/src"
python -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_metadata.py tests/test_samplers.py \
  tests/e2e/test_kv_interface_e2e.py tests/e2e/test_e2e_lifecycle_consistency.py \
  "${deselect[@]}"
for t in tutorial/01_*.py tutorial/02_*.py tutorial/03_*.py tutorial/04_*.py tutorial/05_*.py; do
  echo "== $t"
  python "$here/tutorial.py" "$t" > "$work/tutorial.log" 2>&1 || {
    tail -40 "$work/tutorial.log"; echo "tutorial $t failed on the shim" >&2; exit 1; }
  tail -3 "$work/tutorial.log"
done
echo "TransferQueue 0.1.11 upstream tests and tutorials 01-05 passed on rlferry's shim"
