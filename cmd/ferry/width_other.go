//go:build !(aix || darwin || dragonfly || freebsd || linux || netbsd || openbsd || solaris)

package main

import "os"

// width is 0 (unknown) where the terminal's size cannot be asked for.
func width(*os.File) int { return 0 }
