#!/bin/bash
# A measurement record (output in compile-threads.txt; base = the pjax/ of commit 68afb7f, new = 4b6e4ee):
# warm-up compile time of c = 1 HumanEval configurations: the committed tree (base) against the working tree (new)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
R=$PWD
A="--target random:code-pair --tokenizer $R/out/hold/tok --head random:4 --dataset humaneval
 --concurrency 1 --k 7 --max-new-tokens 8 --drafting none,parallel --scheduling static --no-progress
 --simulate-acceptance 0.8,0.8,0.8,0.8,0.8,0.8,0.8"
for tree in base new; do
  if [ $tree = base ]; then cd $R/out/hold/base; else cd $R; fi
  echo "== $tree $(python3 -c 'import pjax.decode.compiled as c; print(hasattr(c, "COMPILE_THREADS"))')"
  PYTHONPATH=.:/tmp/site timeout 140 python3 -m pjax bench $A --out /tmp/c-$tree 2>&1 | grep "c=1:" | head -2 | tee -a $OUT/compile.txt
done
