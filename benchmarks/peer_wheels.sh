#!/usr/bin/env bash
# Bring flash-attn-4 (an optional benchmark peer) to the GPU machine, which has no internet. Its runtime wheel
# (nvidia-cutlass-dsl-libs-cu13, 92 MB) exceeds what one device call carries (64 MiB), so it travels in two halves
# over two calls on a warm machine (the machine is given back 30 s after a call: make the calls back to back).
#
#   here (has an index):  bash benchmarks/peer_wheels.sh fetch          -> .peers/a (~56 MB), .peers/b (~47 MB)
#   GPU call 1:           run(command="bash benchmarks/peer_wheels.sh stash", carry=[".peers/a"])
#   GPU call 2:           run(command="source benchmarks/peer_wheels.sh install && <bench command>",
#                             carry=[".peers/b"])
# `install` sets PYTHONPATH for the current shell, so source it in the same command as the benchmark, and not inside
# a pipeline (`source ... | tail` runs in a subshell and the export is lost; run 54).
# Versions: flash-attn-4 4.0.0b36 over nvidia-cutlass-dsl 4.8.1 (../shared/notes/gpu-machine.md).
# PEER=flashinfer instead brings FlashInfer (flashinfer-python, a ~100 MB pure wheel, split the same way; the decode
# and MLA decode benches' flashinfer columns; it JIT-builds each kernel with the machine's nvcc on first use, 16-30 s,
# in FLASHINFER_WORKSPACE_BASE).
STASH=/tmp/peers
PEER=${PEER:-fa4}
if [ "$PEER" = flashinfer ]; then
  WHEELS="flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2"; BIG=flashinfer_python-; CHECK=flashinfer
else
  WHEELS="flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5
    apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5"; BIG=nvidia_cutlass_dsl_libs_cu13-; CHECK=flash_attn.cute
fi
case ${1:-} in
  fetch)
    rm -rf .peers && mkdir -p .peers/a .peers/b .peers/dl
    # shellcheck disable=SC2086  # one wheel per word
    pip download --no-deps -d .peers/dl --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all: \
      $WHEELS || exit 1
    big=$(ls .peers/dl/${BIG}*.whl)
    (cd .peers/dl && sha256sum "$(basename "$big")" > ../b/big.sha256)
    split -b 45M "$big" .peers/dl/big.part.
    mv .peers/dl/big.part.aa .peers/a/ && mv .peers/dl/big.part.a[b-z] .peers/b/
    echo "$(basename "$big")" > .peers/b/big.name
    rm "$big" && mv .peers/dl/*.whl .peers/a/ && rmdir .peers/dl
    du -sh .peers/a .peers/b ;;
  stash)
    mkdir -p "$STASH" && cp .peers/a/* "$STASH"/ && ls -la "$STASH" ;;
  install)
    cp .peers/b/big.part.* "$STASH"/
    name=$(cat .peers/b/big.name)
    cat "$STASH"/big.part.* > "$STASH/$name" && (cd "$STASH" && sha256sum -c "$OLDPWD/.peers/b/big.sha256") &&
      pip install --no-index --no-deps --quiet --target "$STASH/site" "$STASH"/*.whl &&
      export PYTHONPATH="$STASH/site:$STASH/site/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}" &&
      export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$STASH/fi-ws} &&
      python3 -c "import $CHECK; print('$CHECK imports')" ;;
  *) echo "usage: $0 fetch|stash|install"; exit 2 ;;
esac
