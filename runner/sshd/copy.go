package sshd

import (
	"errors"
	"io"
	"net"
	"sync"

	"github.com/tandem-run/tandem/common/rawnet"
	gossh "golang.org/x/crypto/ssh"
)

// Copy buffer sizes for forwarded streams. x/crypto/ssh sends a window
// adjust per channel Read and carries at most 32 KiB per packet, and the
// net package's ReadFrom/WriteTo copy 32 KiB at a time whatever buffer
// io.CopyBuffer is given: one Read of a big buffer drains every packet
// already queued, so a bulk -L stream costs one socket write and one window
// adjust per batch instead of per packet (OpenSSH's sshd moves ~200 KiB per
// syscall). On 2 vCPUs that took one -L stream from 348 to 433-446 MiB/s.
const (
	bigCopyBuf   = 256 << 10
	smallCopyBuf = 32 << 10
	// maxBigCopyBufs bounds the big buffers (8 MiB); a stream that finds
	// none free goes on with its small one.
	maxBigCopyBufs = 32
)

// copier carries forwarded streams. A stream waits with a small buffer and
// takes a big one only for a burst (a Read filled the small one), giving it
// back once a Read comes back short: idle forwards (an IDE keeps several
// for hours) hold 32 KiB each, and bulk ones share the bounded big ones.
type copier struct {
	big *rawnet.Buffers
}

func newCopier(maxBig int) *copier {
	return &copier{big: rawnet.NewBuffers(bigCopyBuf, maxBig)}
}

// copy moves src to dst until src ends (true) or an error (false), with
// its own loop so the buffer's size is what each Read gets (io.Copy would
// hand a net.Conn's ReadFrom/WriteTo the job, at 32 KiB a call).
func (c *copier) copy(dst io.Writer, src io.Reader) bool {
	small := make([]byte, smallCopyBuf)
	var big []byte
	defer func() {
		if big != nil {
			c.big.Put(big)
		}
	}()
	for {
		buf := small
		if big != nil {
			buf = big
		}
		n, err := src.Read(buf)
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return false
			}
		}
		if errors.Is(err, io.EOF) {
			return true
		}
		if err != nil {
			return false
		}
		switch {
		case big == nil && n == len(small): // a burst
			big = c.big.Get()
		case big != nil && n < len(small): // drained: wait small
			c.big.Put(big)
			big = nil
		}
	}
}

// forward carries a forward channel and its socket until both directions
// end (see pipe) or the channel is closed: by the client, or with the
// connection. Its requests are discarded; their stream closing is how a
// close shows (a Read only sees EOF, as for a half-close).
func (c *copier) forward(ch gossh.Channel, reqs <-chan *gossh.Request, conn net.Conn) {
	gone := make(chan struct{})
	go func() {
		gossh.DiscardRequests(reqs)
		close(gone)
	}()
	c.pipe(ch, rawnet.Wrap(conn), gone)
}

// pipe copies both ways. The end of one direction is passed on as a
// half-close (an SSH EOF, a TCP FIN), as OpenSSH does, so request/response
// protocols that shut their write side down still get their answer; an
// error on either direction, both ending, or gone closes both.
func (c *copier) pipe(a, b io.ReadWriteCloser, gone <-chan struct{}) {
	var once sync.Once
	closeBoth := func() { once.Do(func() { a.Close(); b.Close() }) }
	finished := make(chan struct{})
	defer close(finished)
	go func() {
		select {
		case <-gone:
			closeBoth()
		case <-finished:
		}
	}()
	var wg sync.WaitGroup
	wg.Add(2)
	half := func(dst, src io.ReadWriteCloser) {
		defer wg.Done()
		cw, ok := dst.(interface{ CloseWrite() error })
		if !c.copy(dst, src) || !ok || cw.CloseWrite() != nil {
			closeBoth()
		}
	}
	go half(a, b)
	go half(b, a)
	wg.Wait()
	closeBoth()
}
