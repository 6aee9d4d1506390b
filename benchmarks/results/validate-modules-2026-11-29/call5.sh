#!/bin/bash
# Call 4's commands again after its two fixes: the reconfigure GPU test over the vmm backend's
# floors, and a real module's LoRA rows timed until settled on one set-up each (call 4 ran ten
# steps a row).
exec bash "$(dirname "$0")/call4.sh" "$@"
