#!/bin/sh
echo "shell"
