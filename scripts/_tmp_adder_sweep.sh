#!/bin/bash
# TEMPORARY sweep driver (to be deleted)
export OMP_NUM_THREADS=1
cd "$(dirname "$0")"
EX=450000
: > $OUT/cfgs.txt
for s in 0 1 2; do
 for lr in 1e-3 2e-3 3e-3; do echo "--d 48 --L 2 --f 192 --bs 128 --lr $lr --seed $s --examples $EX" >> $OUT/cfgs.txt; done
 echo "--d 48 --L 2 --f 192 --bs 64 --lr 1e-3 --seed $s --examples $EX" >> $OUT/cfgs.txt
done
for s in 1 2; do echo "--d 64 --L 2 --f 256 --bs 128 --lr 1e-3 --seed $s --examples $EX" >> $OUT/cfgs.txt; done
for s in 0 1; do echo "--d 32 --L 2 --f 128 --bs 128 --lr 3e-3 --seed $s --examples $EX" >> $OUT/cfgs.txt; done
for s in 0 1; do echo "--d 48 --L 3 --f 192 --bs 128 --lr 2e-3 --seed $s --examples $EX" >> $OUT/cfgs.txt; done
cat $OUT/cfgs.txt | xargs -P 18 -I{} sh -c "python3 _tmp_adder_sweep_torch.py {} --eval_every 25000 >> $OUT/results.jsonl 2>>$OUT/err.txt"
wc -l $OUT/results.jsonl
