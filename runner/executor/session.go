package executor

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// sessionMembers lists the pids whose session id is sid, from /proc.
func sessionMembers(procRoot string, sid int) []int {
	entries, err := os.ReadDir(procRoot)
	if err != nil {
		return nil
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join(procRoot, e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid pgrp session ...; comm may contain spaces.
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(s[i+1:])
		if len(f) < 4 {
			continue
		}
		if sess, err := strconv.Atoi(f[3]); err == nil && sess == sid {
			pids = append(pids, pid)
		}
	}
	return pids
}

// signalSession sends sig to every process of the session; it returns how
// many were signalled.
func signalSession(procRoot string, sid int, sig syscall.Signal) int {
	n := 0
	for _, pid := range sessionMembers(procRoot, sid) {
		if syscall.Kill(pid, sig) == nil {
			n++
		}
	}
	return n
}
