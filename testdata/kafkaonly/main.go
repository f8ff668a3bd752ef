// Command kafkaonly is a service that runs on Kafka alone, for
// link_test.go: it imports the root package and package kafka (blank),
// opens a kafka:// URL and a consumer on it, and then tries each URL of
// its arguments, printing for each the Part and Reason of the *URLError
// Open returns, or "opened".
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/consumer"
	_ "github.com/ferrymq/ferry/kafka"
)

func main() {
	ctx := context.Background()
	b, err := ferry.Open(ctx, "kafka://127.0.0.1:9092")
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()
	if _, err := b.NewConsumer(ctx, "orders", consumer.WithName("billing")); err != nil {
		log.Fatal(err)
	}
	for _, u := range os.Args[1:] {
		ob, err := ferry.Open(ctx, u)
		var ue *ferry.URLError
		switch {
		case err == nil:
			ob.Close()
			fmt.Println("opened")
		case errors.As(err, &ue):
			fmt.Printf("%s\t%s\n", ue.Part, ue.Reason)
		default:
			fmt.Printf("error\t%v\n", err)
		}
	}
}
