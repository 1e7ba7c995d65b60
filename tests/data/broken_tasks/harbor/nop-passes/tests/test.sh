#!/bin/bash
# Deliberately broken: the reward does not depend on the workspace.
echo 1 > /logs/verifier/reward.txt
