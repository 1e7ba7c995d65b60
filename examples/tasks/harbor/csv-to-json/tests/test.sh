#!/bin/bash
# Runs from the working directory (/app). Reward 1 when every test passes, else 0.
if python3 /tests/test_outputs.py > /logs/verifier/unittest.txt 2>&1; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
