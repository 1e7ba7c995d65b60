#!/bin/bash
# Two named scores (reward.json): the file exists, and holds exactly the word. The reward is their mean.
exists=0; content=0
[ -f /app/value.txt ] && exists=1
[ "$(cat /app/value.txt 2>/dev/null)" = "river" ] && content=1
echo "{\"exists\": $exists, \"content\": $content}" > /logs/verifier/reward.json
