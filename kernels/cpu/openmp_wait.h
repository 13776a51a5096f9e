// The wait policy of the OpenMP threads the CPU kernels (and OpenBLAS) run on.
//
// libgomp's default has every idle thread spin about 300,000 iterations at each barrier before
// it sleeps. A decode step runs about a hundred parallel regions, so on an idle machine the
// spinning saves a wake-up per region; but when another process wants the cores (a second
// worker on the same machine, a pod beside it on a Kubernetes node, a build) the spinners burn
// its time slices and each region waits for a thread the kernel has descheduled. Measured with
// bench/omp_wait_bench.py on 2 cores (bench/RESULTS.md): two Q8_0 decodes at once reached
// 13-17 tokens/s in total under the default and 43 with a spin of 300 iterations, for about 13%
// less speed alone (passive, no spin: 40 together, 25% less alone). libgomp reads its policy
// from the environment once, before main runs, so a process that wants another one has to set
// it and start again. The worker, and `kvgrid serve` (whose workers inherit it), choose the
// short spin; in-process CLI commands keep libgomp's default.
#ifndef KVGRID_KERNELS_CPU_OPENMP_WAIT_H_
#define KVGRID_KERNELS_CPU_OPENMP_WAIT_H_

namespace kvgrid::kernels::cpu {

// What ChooseOpenMpWaitPolicy sets: GOMP_SPINCOUNT, iterations spun before sleeping.
inline constexpr const char* kOpenMpSpinCount = "300";
// Set in the environment once the policy is chosen (children inherit it and keep the choice).
inline constexpr const char* kOpenMpWaitChosenEnv = "KVGRID_OMP_WAIT_CHOSEN";

// Unless OMP_WAIT_POLICY, GOMP_SPINCOUNT or kOpenMpWaitChosenEnv is set (a user's choice
// wins), sets GOMP_SPINCOUNT to kOpenMpSpinCount and kOpenMpWaitChosenEnv, and re-executes the
// running program (/proc/self/exe) with the same command line (/proc/self/cmdline, so that a
// program started through its dynamic loader starts through it again). Returns only when
// nothing was to be done or the re-exec failed (then libgomp's default stays). Call first thing
// in main, before any thread starts. Tools that follow a process (valgrind without
// --trace-children, gdb) see the re-exec: set kOpenMpWaitChosenEnv=1 for them.
void ChooseOpenMpWaitPolicy(char** argv);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_OPENMP_WAIT_H_
