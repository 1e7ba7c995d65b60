#!/bin/bash
# All or nothing: the right names and an untouched file.
cd /app/photos || { echo 0 > /logs/verifier/reward.txt; exit 0; }
names=$(ls | sort | tr '\n' ' ')
if [ "$names" = "beach.jpg city.jpg notes.txt " ] && [ "$(cat beach.jpg)" = "jpeg-data-1" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
