package consumer_test

import (
	"context"
	"fmt"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/memory"
)

// A Broker is used through the contract alone; what it does beyond the
// contract is found by type assertion: here it creates its queue
// (consumer.Admin), and reads it without consuming (consumer.Peeker).
func ExampleAdmin() {
	ctx := context.Background()
	mb, err := memory.New(memory.WithAutoCreate(false))
	if err != nil {
		fmt.Println(err)
		return
	}
	var b consumer.Broker = mb
	defer b.Close()

	if adm, ok := b.(consumer.Admin); ok {
		if err := adm.CreateSource(ctx, "orders", consumer.SourceConfig{}); err != nil {
			fmt.Println(err)
			return
		}
	}
	if err := b.Publish(ctx, "orders", consumer.Message{ID: "o-1", Body: []byte("one order")}); err != nil {
		fmt.Println(err)
		return
	}
	if p, ok := b.(consumer.Peeker); ok {
		msgs, err := p.Peek(ctx, "orders", 10)
		if err != nil {
			fmt.Println(err)
			return
		}
		for _, m := range msgs {
			fmt.Printf("%s: %s\n", m.ID, m.Body)
		}
	}
	fmt.Println("system:", b.(consumer.SystemNamer).System())
	// Output:
	// o-1: one order
	// system: ferry_memory
}
