#!/bin/bash
# Runs inside the task's image, where the RUN step made /opt/marker.txt.
cd /app
if cmp -s answer.txt /opt/marker.txt; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
