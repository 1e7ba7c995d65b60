#!/bin/bash
# Runs inside the task's image: its python3, its ENV, its files outside /app, as its USER.
cd /app
ok=1
sh /opt/csv-sum/check_input.sh || { echo "input file changed or ENV missing"; ok=0; }
[ "$(id -u)" = 1001 ] || { echo "not running as the image's USER (uid $(id -u))"; ok=0; }
expected=$(python3 -c "print(sum(int(x) for x in open('/app/data/numbers.csv').read().split()))")
[ "$(cat answer.txt 2>/dev/null)" = "$expected" ] || { echo "answer.txt is not $expected"; ok=0; }
echo $ok > /logs/verifier/reward.txt
