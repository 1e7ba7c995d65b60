#!/bin/bash
# Deliberately broken: checks the file but never writes a reward.
grep -q done /app/out.txt
