#!/bin/bash
printf piano > /app/answer.txt
