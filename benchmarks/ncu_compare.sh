#!/usr/bin/env bash
# Issue 22: Nsight Compute on one 1M-key decode launch of the bf16 Triton kernel and of the CUDA fp8 kernel, side by
# side (where the fp8 kernel's time goes when it moves 2.7 TB/s against bf16's 4.2). On the device machine:
#   source /tmp/site/env.sh && OUT=/tmp/out bash benchmarks/ncu_compare.sh
set -u
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu here"; exit 0; }
METRICS=dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum
METRICS=$METRICS,lts__t_requests_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors.sum
METRICS=$METRICS,l1tex__t_requests_pipe_lsu_mem_global_op_ldgsts.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum
METRICS=$METRICS,lts__d_sectors_fill_sysmem.sum,lts__t_sectors_srcunit_tex_aperture_device_op_read_lookup_miss.sum
for kernel in ${KERNELS:-_paged_decode_kernel cpattn_fp8_decode}; do
  echo "=== $kernel"
  timeout "${NCU_LIMIT:-120}" "$NCU" -k "regex:$kernel" -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section MemoryWorkloadAnalysis_Tables --section SchedulerStats --section LaunchStats --metrics "$METRICS" \
    python3 -c "import sys; sys.path.insert(0, 'benchmarks')
import fp8_cuda_probe as p; p.probe(1, 1 << 20, [{}])" 2>&1 | tee "$OUT/ncu_$kernel.log" \
    | grep -v -E "Warning|warn|^==PROF==|^\s*$" | grep -E "^\s+[A-Za-z_].*[0-9]$|Section|Duration" | head -90
done
