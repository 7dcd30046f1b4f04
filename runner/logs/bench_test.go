package logs

import (
	"bytes"
	"testing"
	"time"
)

func BenchmarkStripperLines(b *testing.B) {
	line := append(bytes.Repeat([]byte("0"), 99), '\r', '\n')
	chunk := bytes.Repeat(line, 40) // ~4 KiB, one pty read
	s := NewStripper(func([]byte) {})
	s.IdleFlush, s.ForceFlush = time.Hour, time.Hour
	b.SetBytes(int64(len(chunk)))
	for i := 0; i < b.N; i++ {
		_, _ = s.Write(chunk)
	}
}
