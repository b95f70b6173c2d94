//go:build !linux

// Command scale measures a sluice node under many agents; it reads /proc
// and sets Linux resource limits, so it runs on Linux only.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "scale: runs on Linux only (it reads /proc)")
	os.Exit(2)
}
