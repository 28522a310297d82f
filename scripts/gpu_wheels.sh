#!/usr/bin/env bash
# Fetch, where pip reaches a package index, what a GPU machine with no network needs to run
# spacy-lean's GPU tests and benchmarks: Python 3.12 on x86-64, a machine that already has
# torch (CUDA), cupy, numpy, pytest, pytest-timeout, hypothesis and matplotlib (the device
# tool's 'cuda' image).
#
# The wheels (74 MB) are unpacked, their compiled modules stripped of debug information
# (spaCy's and blis's are shipped with it: 189 MB of .so files, 66 MB without) and packed
# into one xz tarball, .whl/site.tar.xz (about 20 MB, git-ignored), so that everything
# travels with the working tree in one device call and unpacks in seconds there:
#
#   bash scripts/gpu_wheels.sh            # then see docs/development.md#on-a-gpu
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The versions this checkout is tested with (CI installs the newest that setup.cfg allows).
# transformers 4.53 needs tokenizers < 0.22 and huggingface_hub < 1.0: the image's newer
# ones are shadowed, as /tmp/site comes first on PYTHONPATH.
WHEELS=(spacy==3.8.18 transformers==4.53.2 spacy-transformers==1.4.0 spacy-alignments==0.9.3
   spacy-legacy==3.0.12 spacy-loggers==1.0.5 catalogue==2.0.10 confection==1.3.4 wasabi==1.1.3
   weasel==1.0.1 cloudpathlib==0.26.0 huggingface_hub==0.36.2 cymem==2.0.16 murmurhash==1.0.16
   preshed==3.0.15
   # Not in that image either: pydantic (spaCy's config validation) and smart_open (weasel).
   thinc==8.3.14 blis==1.3.4 srsly==2.5.6 tokenizers==0.21.4 pydantic==2.14.4 pydantic_core==2.50.5
   annotated-types==0.8.0 typing-inspection==0.4.5 smart_open==9.0.2)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$WORK/wheels" "${WHEELS[@]}"
# spacy-lean's own metadata only, so that its entry points (factories, readers, `spacy lean`)
# are registered there; the checkout's code is what runs (it comes first on PYTHONPATH).
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/self" .
mkdir -p "$WORK/site"
for wheel in "$WORK"/wheels/*.whl; do
  unzip -q -o "$wheel" -d "$WORK/site"
done
unzip -q -o "$WORK"/self/spacy_lean-*.whl '*.dist-info/*' -d "$WORK/site"
find "$WORK/site" -name '*.so' -exec strip --strip-debug {} +
find "$WORK/site" \( -name '*.pyx' -o -name '*.pxd' -o -name '*.cpp' \) -delete
mkdir -p .whl
rm -rf .whl/a .whl/b  # the two wheel folders of earlier checkouts
XZ_OPT=-6 tar -cJf .whl/site.tar.xz -C "$WORK/site" .
du -h .whl/site.tar.xz
