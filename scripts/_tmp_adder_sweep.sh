#!/bin/bash
# TEMPORARY sweep driver (to be deleted)
export OMP_NUM_THREADS=1
cd "$(dirname "$0")"
python3 _tmp_adder_sweep_torch.py --d 32 --L 1 --f 64 --bs 64 --lr 1e-3 --examples 2000 --eval_every 1000 --ndp 0.2,0.3,0.5 | tail -1 || exit 1
EX=300000
: > $OUT/cfgs.txt
for s in 0 1 2 3 4 5; do
 echo "--d 48 --L 3 --f 192 --bs 128 --lr 2e-3 --seed $s --examples $EX --ndp 0.2,0.3,0.5" >> $OUT/cfgs.txt
 echo "--d 48 --L 2 --f 192 --bs 128 --lr 2e-3 --seed $s --examples 400000 --ndp 0.2,0.3,0.5" >> $OUT/cfgs.txt
done
for s in 0 1 2 3; do echo "--d 48 --L 3 --f 192 --bs 128 --lr 3e-3 --seed $s --examples $EX" >> $OUT/cfgs.txt; done
for s in 0 1; do echo "--d 48 --L 3 --f 192 --bs 128 --lr 3e-3 --seed $s --examples $EX --ndp 0.2,0.3,0.5" >> $OUT/cfgs.txt; done
cat $OUT/cfgs.txt | xargs -P 18 -I{} sh -c "python3 _tmp_adder_sweep_torch.py {} --eval_every 25000 >> $OUT/results.jsonl 2>>$OUT/err.txt"
wc -l $OUT/results.jsonl
