package ptyproc

import (
	"errors"
	"os/exec"
	"syscall"
	"testing"
)

func TestExitStatus(t *testing.T) {
	tests := []struct {
		name   string
		script string
		code   int
		signal syscall.Signal
	}{
		{"success", "exit 0", 0, 0},
		{"exit code", "exit 3", 3, 0},
		{"killed by TERM", "kill -TERM $$", 128 + 15, syscall.SIGTERM},
		{"killed by KILL", "kill -KILL $$", 128 + 9, syscall.SIGKILL},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command("/bin/sh", "-c", tc.script)
			err := cmd.Run()
			code, sig := ExitStatus(cmd.ProcessState)
			if code != tc.code || sig != tc.signal {
				t.Errorf("ExitStatus = %d, %v; want %d, %v", code, sig, tc.code, tc.signal)
			}
			if got := FromWait(err); got != tc.code {
				t.Errorf("FromWait = %d, want %d", got, tc.code)
			}
		})
	}
	if got := FromWait(errors.New("wait failed")); got != 255 {
		t.Errorf("a failed wait: %d", got)
	}
	if code, _ := ExitStatus(nil); code != 255 {
		t.Errorf("no process state: %d", code)
	}
}
