// Package memory is an in-process message broker with real queue semantics:
// Ferry's embedded default for demos and the broker to use in unit tests of
// handlers and middleware. It behaves like an SQS queue, minus the network.
//
// # What it guarantees
//
// A message published to a queue stays there until a consumer acknowledges
// it. Fetching a message does not remove it: it leases it. The message is
// hidden from every other fetch for the queue's visibility timeout, and its
// receive count grows by one (that count is the delivery's Message.Deliveries). Then one
// of three things happens:
//
//   - The consumer acks it: it is deleted.
//   - The consumer returns it, with a delay or none: it becomes visible again
//     once the delay has passed.
//   - The lease runs out (the consumer died, or its handler outlived the
//     visibility timeout without extending the lease): it becomes visible
//     again and is delivered to whoever fetches next. Nothing is lost when a
//     consumer dies mid-handler.
//
// Every delivery carries its own handle, like an SQS receipt handle. Only the
// newest delivery of a message, and only while its lease lasts, can settle or
// extend it: a consumer that comes back after its lease ran out gets
// [ErrStaleHandle] and cannot ack or extend the delivery someone else now
// holds.
//
// A queue with MaxReceiveCount > 0 moves a message that was received that
// many times to its DeadLetterQueue instead of delivering it again, as SQS
// redrive does, with the headers [HeaderSourceQueue] and [HeaderReceiveCount]
// added.
//
// A FIFO queue keeps order per message group (Message.Key): a group delivers
// one message at a time, in publish order, and delivers nothing more until
// that message is acked or dead-lettered; a returned message goes back to
// the head of its group. Other groups flow meanwhile. Deliveries from a FIFO
// queue carry the group as their Lane, so a consumer.Loop keeps the order
// too. A FIFO queue drops a message whose ID it took within the last five
// minutes ([WithDedupWindow]), as SQS deduplication does. Standard queues
// deliver in about publish order and keep no order after a redelivery; their
// deliveries have Lane "". Offset is -1 on both kinds.
//
// # Using it
//
// [New] returns a [Broker]; [Broker.CreateQueue] configures a queue (by default, Publish,
// Driver and NewConsumer create a queue they do not know with the zero
// [QueueConfig]: see [WithAutoCreate]). Broker is a consumer.Publisher; it copies
// bodies and headers on publish, and each delivery gets its own copy, so
// neither publishers nor handlers can change what is stored.
// [Broker.NewConsumer] returns a [consumer.Loop] over a queue; Driver returns the raw
// consumer/driver.Driver, which also implements driver.Extender (the lease is
// the visibility timeout) and driver.LagReporter. [Broker.Stats] and
// [Broker.Messages] let a test look inside a queue, for example at what
// reached a dead-letter queue.
//
// A handler reaches the broker's own view of its delivery through
// [consumer.Message.As] with a *[Delivery] (queue, message id, receive
// count, group, and whether the delivery is still current). When the loop
// hands a message back, the broker keeps the handler runs the loop reports
// with it (driver.Settlement.History) and gives them back with the next
// delivery, as a broker-side attempt count would, so Message.Attempt stays
// exact across consumers of one Broker.
//
// The broker is safe for concurrent use. It runs no goroutines of its own:
// delays and visibility timeouts are deadlines in one heap per queue, looked
// at by the fetches that wait on the queue. Close makes waiting fetches return
// an error wrapping [ErrClosed], marked driver.Fatal, so a consumer.Loop's Run
// ends. Nothing is persisted: messages live as long as the Broker.
package memory
