package cluster_test

import (
	"fmt"
	"os/exec"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
)

func setHandling(t *testing.T, n int, mode string) {
	out, err := exec.Command("runuser", "-u", "rabbitmq", "--", "env", "HOME=/var/lib/rabbitmq",
		"/usr/lib/rabbitmq/bin/rabbitmqctl", "-n", fmt.Sprintf("eo-h1%d@localhost", n), "eval",
		fmt.Sprintf("application:set_env(rabbit, cluster_partition_handling, %s).", mode)).CombinedOutput()
	require.NoError(t, err, string(out))
}

func TestProbeIgnore(t *testing.T) {
	start := time.Now()
	log := func(f string, a ...any) { t.Logf("%6.2fs "+f, append([]any{time.Since(start).Seconds()}, a...)...) }
	q := fmt.Sprintf("probe-%d", time.Now().UnixNano())
	conn, err := amqp091.Dial(rabbit.URL(1))
	require.NoError(t, err)
	ch, err := conn.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDeclare(q, true, false, false, false, amqp091.Table{"x-queue-type": "quorum"})
	require.NoError(t, err)
	setHandling(t, 1, "ignore")
	defer setHandling(t, 1, "pause_minority")
	require.NoError(t, ch.Confirm(false))
	cl := conn.NotifyClose(make(chan *amqp091.Error, 1))
	go func() { e := <-cl; log("conn closed: %v", e) }()
	require.NoError(t, rabbit.Kill(2))
	require.NoError(t, rabbit.Kill(3))
	log("killed 2,3")
	try := func(name string, f func() error) {
		done := make(chan error, 1)
		go func() { done <- f() }()
		select {
		case err := <-done:
			log("%s: %v", name, err)
		case <-time.After(8 * time.Second):
			log("%s: no answer in 8s", name)
		}
	}
	dc, err := ch.PublishWithDeferredConfirm("", q, true, false, amqp091.Publishing{Body: []byte("b")})
	log("publish err %v", err)
	go func() { <-dc.Done(); log("old-channel confirm acked=%v", dc.Acked()) }()
	c2, err := amqp091.Dial(rabbit.URL(1))
	log("dial node1: %v", err)
	if err == nil {
		ch2, _ := c2.Channel()
		ch2.Confirm(false)
		try("new channel publish", func() error {
			dc, err := ch2.PublishWithDeferredConfirm("", q, true, false, amqp091.Publishing{Body: []byte("c")})
			if err != nil {
				return err
			}
			<-dc.Done()
			return fmt.Errorf("acked=%v", dc.Acked())
		})
		ch3, _ := c2.Channel()
		try("declare existing", func() error {
			_, err := ch3.QueueDeclare(q, true, false, false, false, amqp091.Table{"x-queue-type": "quorum"})
			return err
		})
		ch4, _ := c2.Channel()
		try("declare new", func() error {
			_, err := ch4.QueueDeclare(q+"-new", true, false, false, false, amqp091.Table{"x-queue-type": "quorum"})
			return err
		})
		ch5, _ := c2.Channel()
		try("consume", func() error {
			_, err := ch5.Consume(q, "", false, false, false, false, nil)
			return err
		})
	}
	time.Sleep(5 * time.Second)
	require.NoError(t, startNodes(2, 3))
	log("restarted")
	time.Sleep(5 * time.Second)
	qs, _ := rabbit.Queues(q)
	log("queues %+v", qs)
	deleteQueues(t, q, q+"-new")
}
