#!/usr/bin/env bash
# Builds .gpu-kit/train: speculators' trainer and what the lent GPU machine's python lacks for it (its own torch,
# transformers, pyarrow and pandas serve; the vLLM kit's part 3 brings pydantic, openai and the rest). Run here, in
# the repo root, where the package registry answers; then on the device, after the kit's part 3, in the same call:
#   bash .gpu-kit/train/stage.sh            (carry [".gpu-kit/train"], 3.6 MB)
set -euo pipefail
dest=.gpu-kit/train
mkdir -p "$dest"
python3 -m pip download -q --no-deps --dest "$dest" --python-version 3.12 --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  speculators==0.9.0 datasets==5.1.0 loguru==0.7.3 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
  multiprocess==0.70.19 typer==0.29.2 shellingham==1.5.4 xxhash==4.1.0 fsspec==2026.7.0 rich==15.0.0 \
  annotated-doc markdown-it-py mdurl pygments
cat > "$dest/stage.sh" <<'STAGE'
#!/usr/bin/env bash
# After the kit's part 3, in the same call: speculators' trainer and what the device's python lacks for it.
set -u
[ -f /tmp/stage/part3.done ] || { echo "FRESH MACHINE: stage parts 1..3 first"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu-kit/train/*.whl \
  || { echo "pip install of the train wheels failed"; exit 1; }
echo "train kit staged"
STAGE
chmod +x "$dest/stage.sh"
du -sh "$dest"
