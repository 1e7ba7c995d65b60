#!/bin/bash
# One named score per file (reward.json): the reward is their mean.
score() { [ "$(cat "/app/$1" 2>/dev/null)" = "$2" ] && echo 1 || echo 0; }
printf '{"a.txt": %s, "data.txt": %s, "note.txt": %s}\n' "$(score a.txt apple)" "$(score data.txt river)" \
  "$(score note.txt piano)" > /logs/verifier/reward.json
