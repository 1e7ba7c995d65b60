#!/bin/bash
if grep -qx "build ok: 3 targets" /app/build.log 2>/dev/null; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
