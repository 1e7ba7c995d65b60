#!/bin/bash
set -e
cd /app/docs
for f in $(ls | sort); do
  echo "$f,$(wc -w < "$f" | tr -d ' ')"
done > /app/counts.csv
