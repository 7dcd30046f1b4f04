package ptyio

import (
	"bytes"
	"os"
	"testing"
	"time"

	"github.com/creack/pty"
	"golang.org/x/sys/unix"
)

// control runs fn on f's descriptor without os.File.Fd, which would make
// it blocking again.
func control(t *testing.T, f *os.File, fn func(fd int) (int, error)) int {
	t.Helper()
	rc, err := f.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var v int
	var ferr error
	if err := rc.Control(func(fd uintptr) { v, ferr = fn(int(fd)) }); err != nil || ferr != nil {
		t.Fatal(err, ferr)
	}
	return v
}

// pty.Open hands over a blocking master (it takes the descriptor with
// os.File.Fd); a Reader must make it non-blocking, or a raw read of a
// quiet terminal after a full read sleeps in the kernel holding the
// scheduler's P: the whole process waits at the next stop-the-world.
func TestNewReaderMakesTheMasterNonBlocking(t *testing.T) {
	master, tty, err := pty.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer master.Close()
	defer tty.Close()
	flags := func(fd int) (int, error) { return unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0) }
	t.Logf("pty.Open's master is non-blocking: %v", control(t, master, flags)&unix.O_NONBLOCK != 0)
	_ = NewReader(master)
	if control(t, master, flags)&unix.O_NONBLOCK == 0 {
		t.Fatal("the master is still blocking after NewReader")
	}
}

// Reader delivers what the terminal's other side writes, in order,
// whether it was there before the read or came while the reader waited,
// and ends with an error (EIO) once that side is closed: no hang.
func TestReaderPty(t *testing.T) {
	master, tty, err := pty.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer master.Close()
	read := NewReader(master).Read
	want := bytes.Repeat([]byte("0123456789abcdef"), 8<<10) // 128 KiB, many pty buffers
	_, _ = tty.Write([]byte("early\n"))                     // there before the first read
	got := make(chan []byte, 1)
	done := make(chan error, 1)
	go func() {
		var all []byte
		buf := make([]byte, 32<<10)
		for {
			n, err := read(buf)
			all = append(all, buf[:n]...)
			if err != nil {
				got <- all
				done <- err
				return
			}
		}
	}()
	time.Sleep(50 * time.Millisecond) // the reader now waits on an empty terminal
	for off := 0; off < len(want); off += 4000 {
		if _, err := tty.Write(want[off:min(off+4000, len(want))]); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(50 * time.Millisecond)
	tty.Close()
	select {
	case err := <-done:
		t.Logf("the reader ended with %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the reader did not end after the terminal's other side closed")
	}
	all := <-got
	// The terminal turns \n into \r\n on the way.
	if exp := append([]byte("early\r\n"), want...); !bytes.Equal(all, exp) {
		t.Fatalf("read %d bytes, want %d (prefix %q)", len(all), len(exp), all[:min(len(all), 20)])
	}
}

// A hang-up that comes between two Reads may be lost to the poller; Plain
// wakes the waiting Read and the plain read that follows sees the hang-up.
// Before the hang-up, plain reads still deliver input.
func TestReaderPlainAfterHangup(t *testing.T) {
	master, tty, err := pty.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer master.Close()
	r := NewReader(master)
	buf := make([]byte, 1024)
	_, _ = tty.Write([]byte("x"))
	if n, err := r.Read(buf); err != nil || string(buf[:n]) != "x" {
		t.Fatalf("first read: %q %v", buf[:n], err)
	}
	tty.Close() // no Read in progress: the edge may be dropped
	// Idle for a moment: the runtime's poller takes the hang-up's edge now,
	// and the next Read starts by clearing it.
	time.Sleep(50 * time.Millisecond)
	done := make(chan error, 1)
	go func() {
		_, err := r.Read(buf)
		done <- err
	}()
	time.Sleep(100 * time.Millisecond)
	r.Plain()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("a read after the hang-up must fail")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Plain did not end the wait")
	}

	m2, tty2, err := pty.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer m2.Close()
	defer tty2.Close()
	r2 := NewReader(m2)
	r2.Plain()
	_, _ = tty2.Write([]byte("after plain"))
	if n, err := r2.Read(buf); err != nil || string(buf[:n]) != "after plain" {
		t.Fatalf("plain read: %q %v", buf[:n], err)
	}
}

// After a read that took the line discipline's whole buffer the next Read
// goes to the kernel without asking for the count first; when the
// terminal turns out to be empty it must still wait for input, not spin
// or report an end.
func TestReaderWaitsAfterAFullRead(t *testing.T) {
	master, tty, err := pty.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer master.Close()
	defer tty.Close()
	r := NewReader(master)
	wrote := make(chan error, 1)
	go func() {
		_, err := tty.Write(bytes.Repeat([]byte("x"), 3*ldiscBuf))
		wrote <- err
	}()
	// Once the line discipline holds a whole buffer, a Read of it sets
	// the flag.
	deadline := time.Now().Add(5 * time.Second)
	for {
		avail := control(t, master, func(fd int) (int, error) { return unix.IoctlGetInt(fd, unix.TIOCINQ) })
		if avail >= ldiscBuf {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the terminal holds %d bytes after 5 s", avail)
		}
		time.Sleep(time.Millisecond)
	}
	buf := make([]byte, 32<<10)
	n, err := r.Read(buf)
	if err != nil || n < ldiscBuf || !r.full {
		t.Fatalf("a read of a full terminal: %d bytes, %v, full %v", n, err, r.full)
	}
	for got := n; got < 3*ldiscBuf; {
		n, err := r.Read(buf)
		if err != nil {
			t.Fatal(err)
		}
		got += n
	}
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	r.full = true // as if the last read had been full, and the terminal is empty
	type result struct {
		b   string
		err error
	}
	done := make(chan result, 1)
	go func() {
		n, err := r.Read(buf)
		done <- result{string(buf[:n]), err}
	}()
	select {
	case res := <-done:
		t.Fatalf("Read on an empty terminal returned %q %v", res.b, res.err)
	case <-time.After(100 * time.Millisecond):
	}
	_, _ = tty.Write([]byte("tail"))
	select {
	case res := <-done:
		if res.err != nil || res.b != "tail" {
			t.Fatalf("after the wait: %q %v", res.b, res.err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("input after a full read did not wake the reader")
	}
}
