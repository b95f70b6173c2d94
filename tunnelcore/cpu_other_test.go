//go:build !unix

package tunnelcore

import "time"

// processCPU is 0 where the process's CPU time is not read: the
// benchmarks' cpu-s/GB then report 0.
func processCPU() time.Duration { return 0 }
