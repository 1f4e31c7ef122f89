#!/bin/bash
# TEMPORARY sweep driver (to be deleted)
export OMP_NUM_THREADS=1
cd "$(dirname "$0")"
python3 _tmp_adder_sweep_torch.py --d 32 --L 1 --f 64 --bs 64 --lr 1e-3 --examples 2000 --eval_every 1000 || exit 1
EX=${EX:-700000}
: > $OUT/cfgs.txt
for m in "48 2 192" "64 2 256" "64 3 256" "96 2 384" "128 2 512" "128 3 512"; do
 set -- $m
 for bs in 64 128; do for lr in 1e-3 3e-3; do
  echo "--d $1 --L $2 --f $3 --bs $bs --lr $lr --examples $EX" >> $OUT/cfgs.txt
 done; done
done
echo "--d 64 --L 2 --f 256 --bs 256 --lr 3e-3 --examples $EX" >> $OUT/cfgs.txt
echo "--d 96 --L 2 --f 384 --bs 256 --lr 3e-3 --examples $EX" >> $OUT/cfgs.txt
echo "--d 64 --L 4 --f 256 --bs 64 --lr 3e-3 --examples $EX" >> $OUT/cfgs.txt
echo "--d 64 --L 4 --f 256 --bs 128 --lr 3e-3 --examples $EX" >> $OUT/cfgs.txt
cat $OUT/cfgs.txt | xargs -P 16 -I{} sh -c "python3 _tmp_adder_sweep_torch.py {} >> $OUT/results.jsonl 2>>$OUT/err.txt"
wc -l $OUT/results.jsonl
