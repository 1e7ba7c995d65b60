#!/bin/bash
./build.sh > /app/build.log
