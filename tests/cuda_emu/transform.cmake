# Rewrites a CUDA source for the emulator's host compile: device.h first, then the source with
# every `kernel<<<config>>>(args)` turned into `kernel ^ Launch(__FILE__, __LINE__, config)(args)`
# (kernel_api.h), every `extern __shared__` array into the launch's dynamic shared memory, and
# every other `__shared__` array into a static that each block poisons first. `#line` keeps diagnostics and launch sites pointing at the original file.
# Usage: cmake -DIN=<file.cu> -DOUT=<file.cc> -P transform.cmake
file(READ "${IN}" text)
string(REPLACE "<<<" " ^ ::kvgrid::cuda_emu::Launch(__FILE__, __LINE__, " text "${text}")
string(REPLACE ">>>" ")" text "${text}")
# `extern __shared__ T name[];` becomes a pointer to the block's dynamic shared memory.
string(REGEX REPLACE "extern __shared__ ([A-Za-z0-9_:]+) ([A-Za-z0-9_]+)\\[\\];"
       "\\1* const \\2 = static_cast<\\1*>(::kvgrid::cuda_emu::DynamicShared());"
       text "${text}")
# `__shared__ T name[n]...;` (one array, on one line) stays a static array, filled with all-ones
# bytes the first time each block reaches it (a GPU's shared memory starts as garbage).
string(REGEX REPLACE "__shared__ ([^;\n]*[ ]([A-Za-z_][A-Za-z0-9_]*)(\\[[^;\n]*\\])+);"
       "static \\1; ::kvgrid::cuda_emu::PoisonShared(\\2, sizeof(\\2));"
       text "${text}")
file(WRITE "${OUT}.tmp" "#include \"tests/cuda_emu/device.h\"\n#line 1 \"${IN}\"\n${text}")
file(COPY_FILE "${OUT}.tmp" "${OUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUT}.tmp")
