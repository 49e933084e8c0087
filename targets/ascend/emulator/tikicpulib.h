// CANN's CPU-debug header name, served by this project's emulator (ICPU_RUN_KF, GmAlloc).
#pragma once
#include "kernel_operator.h"
