#!/bin/bash
sleep 1
echo "build ok: 3 targets"
