#!/bin/bash
set -e
cd /app/photos
find . -maxdepth 1 -type f -empty -delete
for f in *.jpeg; do mv "$f" "${f%.jpeg}.jpg"; done
