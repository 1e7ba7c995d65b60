#!/bin/bash
bash ./build.sh > /app/build.log
